"""The metric contract: every family gpuwarden exports, its type, labels and help.

Alerts, dashboards and deployment depend on these names; the metric reference (docs/metrics.md) is generated from
this table (tests/test_docs.py fails when it drifts). Per-GPU families get `gpu` and `uuid` first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Literal

GPU_LABELS = ("gpu", "uuid")


@dataclass(frozen=True)
class Family:
    """One metric family of the contract: name, type, help, labels, unit and whether it is per GPU."""

    name: str
    type: Literal["gauge", "counter"]
    help: str
    labels: tuple[str, ...] = ()
    per_gpu: bool = True
    unit: str = ""

    @property
    def all_labels(self) -> tuple[str, ...]:
        return (GPU_LABELS + self.labels) if self.per_gpu else self.labels


# Every family of the contract, in definition order: a family is registered where it is defined, so none can be
# defined and forgotten (docs/metrics.md's metric reference and the tests read this).
FAMILIES: dict[str, Family] = {}


def _node(name: str, type_: Literal["gauge", "counter"], help_: str, *labels: str, unit: str = "") -> Family:
    """A node-level family (no `gpu` and `uuid` labels)."""
    return _f(name, type_, help_, *labels, per_gpu=False, unit=unit)


def _f(
    name: str, type_: Literal["gauge", "counter"], help_: str, *labels: str, per_gpu: bool = True, unit: str = ""
) -> Family:
    """Define a family and register it in FAMILIES; a name defined twice is a bug, found at import."""
    if name in FAMILIES:
        raise ValueError(f"metric family {name} is defined twice")
    family = Family(name, type_, help_, tuple(labels), per_gpu, unit)
    FAMILIES[name] = family
    return family


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

# exporter and node
BUILD_INFO = _node(
    "gpuwarden_build_info",
    "gauge",
    "Build of this exporter; always 1.",
    "version",
    "nvml_python_version",
)
DRIVER_INFO = _node(
    "gpuwarden_driver_info",
    "gauge",
    "NVIDIA driver, CUDA driver API and NVML versions; always 1.",
    "driver_version",
    "cuda_driver_version",
    "nvml_version",
)
NVML_UP = _node("gpuwarden_nvml_up", "gauge", "1 when NVML is initialised and answering, 0 otherwise.")
NVML_ERROR_INFO = _node(
    "gpuwarden_nvml_error_info",
    "gauge",
    "Why NVML is down (present only while gpuwarden_nvml_up is 0); always 1.",
    "error",
)
GPUS = _node("gpuwarden_gpus", "gauge", "GPUs currently visible to NVML.")
GPUS_EXPECTED = _node(
    "gpuwarden_gpus_expected",
    "gauge",
    "GPUs this node should have (nvml.expected_gpus; absent when not set): GpuwardenGpuCountDropped compares "
    "gpuwarden_gpus with it, a fact that survives restarts.",
)
COLLECT_DURATION_SECONDS = _node(
    "gpuwarden_collect_duration_seconds",
    "gauge",
    "Wall time of the last poll of each tier.",
    "tier",
    unit="seconds",
)
LAST_COLLECT_TIMESTAMP_SECONDS = _node(
    "gpuwarden_last_collect_timestamp_seconds",
    "gauge",
    "Unix time the last poll of each tier finished.",
    "tier",
    unit="seconds",
)
COLLECT_ERRORS_TOTAL = _node(
    "gpuwarden_collect_errors_total",
    "counter",
    "NVML errors by call and error; unsupported calls are counted once, then no longer tried.",
    "call",
    "error",
)
COLLECT_TIMEOUTS_TOTAL = _node(
    "gpuwarden_collect_timeouts_total",
    "counter",
    "GPU reads abandoned after the call deadline, by the call they were stuck in.",
    "call",
)
NVML_REINIT_TOTAL = _node(
    "gpuwarden_nvml_reinit_total",
    "counter",
    "Times NVML was re-initialised after a lifecycle error.",
)
HTTP_REJECTED_TOTAL = _node(
    "gpuwarden_http_rejected_total",
    "counter",
    "Connections and requests the HTTP server refused to protect probes and scrapes: header_timeout (a request "
    "not whole in time), header_too_large, evicted (at the connection limit: one closing with its response unread, "
    "else the oldest still sending a request), shed (request limit; probes and scrapes never), auth_failed, "
    "auth_shed (password checks already queued), "
    "write_timeout (a response the client did not read), body_too_large, pipeline (more than 16 requests queued on "
    "a connection), bad_request (malformed HTTP), handshake_limit (the oldest TLS handshake in progress "
    "closed when 256 were).",
    "reason",
)
CONFIG_RELOADS_TOTAL = _node(
    "gpuwarden_config_reloads_total",
    "counter",
    "Configuration reloads (SIGHUP) by result: applied, or rejected (the running configuration stays).",
    "result",
)
# profiling-class activity from NVML GPM (Hopper and newer): seconds of activity accumulated window by window,
# so rate(x_seconds_total) / rate(gpuwarden_gpm_window_seconds_total) is the true mean over any range
GPM_WINDOW_SECONDS_TOTAL = _f(
    "gpuwarden_gpm_window_seconds_total",
    "counter",
    "Seconds covered by GPM sample windows: the denominator of every gpuwarden_gpm_*_seconds_total ratio.",
    unit="seconds",
)
GPM_GRAPHICS_ACTIVE_SECONDS_TOTAL = _f(
    "gpuwarden_gpm_graphics_active_seconds_total",
    "counter",
    "Seconds the graphics/compute engine was active (GPM GRAPHICS_UTIL x window; DCGM's GR_ENGINE_ACTIVE).",
    unit="seconds",
)
GPM_SM_ACTIVE_SECONDS_TOTAL = _f(
    "gpuwarden_gpm_sm_active_seconds_total",
    "counter",
    "SM-seconds active averaged over the SMs (GPM SM_UTIL x window; DCGM's SM_ACTIVE): unlike GPU utilization, "
    "one busy SM of 132 counts 1/132.",
    unit="seconds",
)
GPM_SM_OCCUPANCY_SECONDS_TOTAL = _f(
    "gpuwarden_gpm_sm_occupancy_seconds_total",
    "counter",
    "Resident warps as a share of the maximum, times seconds (GPM SM_OCCUPANCY x window; DCGM's SM_OCCUPANCY).",
    unit="seconds",
)
GPM_PIPE_ACTIVE_SECONDS_TOTAL = _f(
    "gpuwarden_gpm_pipe_active_seconds_total",
    "counter",
    "Seconds each math pipe was active: tensor (any tensor core), fp64, fp32, fp16 (GPM *_UTIL x window; DCGM's "
    "PIPE_*_ACTIVE).",
    "pipe",
    unit="seconds",
)
GPM_DRAM_ACTIVE_SECONDS_TOTAL = _f(
    "gpuwarden_gpm_dram_active_seconds_total",
    "counter",
    "Seconds of device-memory bandwidth use as a share of the peak (GPM DRAM_BW_UTIL x window; DCGM's DRAM_ACTIVE).",
    unit="seconds",
)
NVLINK_BYTES_TOTAL = _f(
    "gpuwarden_nvlink_bytes_total",
    "counter",
    "Bytes over all of the GPU's NVLinks, by direction (GPM NVLINK_TOTAL_RX/TX_PER_SEC x window).",
    "direction",
    unit="bytes",
)
# per MIG GPU instance (nvmlGpmMigSampleGet): the same activity for each slice of a MIG-enabled GPU
MIG_GPM_WINDOW_SECONDS_TOTAL = _f(
    "gpuwarden_mig_gpm_window_seconds_total",
    "counter",
    "Seconds covered by the MIG GPU instance's GPM sample windows: the denominator of its activity ratios.",
    "gpu_instance",
    "mig_uuid",
    unit="seconds",
)
MIG_GPM_GRAPHICS_ACTIVE_SECONDS_TOTAL = _f(
    "gpuwarden_mig_gpm_graphics_active_seconds_total",
    "counter",
    "Seconds the MIG GPU instance's graphics/compute engine was active (GPM GRAPHICS_UTIL x window).",
    "gpu_instance",
    "mig_uuid",
    unit="seconds",
)
MIG_GPM_SM_ACTIVE_SECONDS_TOTAL = _f(
    "gpuwarden_mig_gpm_sm_active_seconds_total",
    "counter",
    "SM-seconds active averaged over the MIG GPU instance's SMs (GPM SM_UTIL x window).",
    "gpu_instance",
    "mig_uuid",
    unit="seconds",
)
MIG_GPM_PIPE_ACTIVE_SECONDS_TOTAL = _f(
    "gpuwarden_mig_gpm_pipe_active_seconds_total",
    "counter",
    "Seconds each math pipe of the MIG GPU instance was active: tensor, fp64, fp32, fp16.",
    "gpu_instance",
    "mig_uuid",
    "pipe",
    unit="seconds",
)
MIG_GPM_DRAM_ACTIVE_SECONDS_TOTAL = _f(
    "gpuwarden_mig_gpm_dram_active_seconds_total",
    "counter",
    "Seconds of the MIG GPU instance's memory-bandwidth use as a share of its peak (GPM DRAM_BW_UTIL x window).",
    "gpu_instance",
    "mig_uuid",
    unit="seconds",
)
# per MIG slice (its MIG device handle): what its workload sees as its GPU
MIG_MEMORY_USED_BYTES = _f(
    "gpuwarden_mig_memory_used_bytes",
    "gauge",
    "Memory used in the MIG GPU instance (nvmlDeviceGetMemoryInfo on its MIG device): a slice runs out of memory "
    "at its own total, not the GPU's.",
    "gpu_instance",
    "mig_uuid",
    unit="bytes",
)
MIG_MEMORY_TOTAL_BYTES = _f(
    "gpuwarden_mig_memory_total_bytes",
    "gauge",
    "Memory of the MIG GPU instance (its profile's share of the GPU).",
    "gpu_instance",
    "mig_uuid",
    unit="bytes",
)
MIG_INSTANCE_INFO = _f(
    "gpuwarden_mig_instance_info",
    "gauge",
    "1 per MIG GPU instance, with its profile as nvidia-smi names it (1g.10gb; unknown where the driver cannot "
    "say) and its NVML profile ID.",
    "gpu_instance",
    "mig_uuid",
    "profile",
    "profile_id",
)
# NVSwitch fabric (nvmlDeviceGetGpuFabricInfoV): on HGX/NVL systems CUDA cannot start on a GPU whose fabric Fabric
# Manager has not set up, while every other reading looks healthy
FABRIC_STATE = _f(
    "gpuwarden_fabric_state",
    "gauge",
    "1 for the GPU's NVSwitch fabric state: not_started (Fabric Manager has not set it up), in_progress or "
    "completed; no series on a GPU without NVSwitch. Default: only the states other than completed (group "
    "fabric_detail for every state).",
    "state",
)
FABRIC_HEALTH = _f(
    "gpuwarden_fabric_health",
    "gauge",
    "1 while a fabric health condition holds (degraded_bandwidth, route_recovery, route_unhealthy, "
    "access_timeout_recovery, incorrect_configuration, gfm_disconnected, registration_failed), else 0. Default: "
    "only those that hold (group fabric_detail for all).",
    "condition",
)
FABRIC_INFO = _f(
    "gpuwarden_fabric_info",
    "gauge",
    "1 per GPU with an NVSwitch fabric: its clique ID, cluster UUID and the driver's health summary (healthy, "
    "limited_capacity, unhealthy, not_supported). Group fabric_detail.",
    "clique_id",
    "cluster_uuid",
    "summary",
)
GPM_UNAVAILABLE_INFO = _f(
    "gpuwarden_gpm_unavailable_info",
    "gauge",
    "Present (1) when the GPU supports GPM but profiling cannot be read, with the reason (e.g. no_permission: the "
    "driver restricts profiling to admins, RmProfilingAdminOnly=1). A GPU without GPM has no profiling series.",
    "reason",
)
# health (exporter/gpuwarden/health): derived from the readings below with the thresholds of the alert rules
HEALTH = _f(
    "gpuwarden_health",
    "gauge",
    "Health verdict per check: 0 ok, 1 warning, 2 critical (sustained conditions judged over the exporter's own "
    "samples, with the alert rules' thresholds and durations).",
    "check",
)
HEALTH_SINCE_TIMESTAMP_SECONDS = _f(
    "gpuwarden_health_since_timestamp_seconds",
    "gauge",
    "Unix time the current non-ok verdict of the check began, as this exporter saw it (present only while "
    "gpuwarden_health > 0; kept across restarts where the state file is, health.state_file).",
    "check",
    unit="seconds",
)
HEALTH_STATUS = _f(
    "gpuwarden_health_status",
    "gauge",
    "The worst gpuwarden_health verdict of the GPU: 0 ok, 1 warning, 2 critical.",
)
HEALTH_PENDING = _f(
    "gpuwarden_health_pending",
    "gauge",
    "Present while a check is pending: its condition holds but has not yet been watched for its window (after a "
    "start without the state file, or a new onset), or its readings have not been read yet. The value is the level "
    "the check turns into if the condition lasts (1 warning, 2 critical); gpuwarden_health reads 0 meanwhile.",
    "check",
)
BOTTLENECK_INFO = _f(
    "gpuwarden_bottleneck_info",
    "gauge",
    "What the GPU's time went to over the bottleneck window (GPM): idle, tensor_bound, memory_bound, "
    "compute_without_tensor, sm_bound_non_matmul, communication_bound, host_transfer_bound, collective_wait, "
    "launch_bound, waiting or mixed; always 1.",
    "class",
)
# pod attribution (exporter/podresources): kubelet pod-resources, refreshed in the background
POD_ATTRIBUTION_UP = _node(
    "gpuwarden_pod_attribution_up",
    "gauge",
    "1 when the last kubelet pod-resources List succeeded; 0 when the socket is absent or the call fails "
    "(absent when pods.attribution is off).",
)
POD_ATTRIBUTION_UNMATCHED_DEVICES = _node(
    "gpuwarden_pod_attribution_unmatched_devices",
    "gauge",
    "Allocated GPU device IDs that name no GPU (nor MIG instance) visible to this exporter.",
)
GPU_ALLOCATION = _f(
    "gpuwarden_gpu_allocation",
    "gauge",
    "1 for each container the kubelet allocated the GPU to (several under time-slicing, MPS or MIG); join with "
    "`* on(uuid) group_left(namespace, pod, container)`.",
    "namespace",
    "pod",
    "container",
)
# per-GPU identity and state
# who holds the GPU (exporter/gpuwarden/attribution/processes.py): per container by default, per PID opt-in
CONTAINER_GPU_MEMORY_USED_BYTES = _f(
    "gpuwarden_container_gpu_memory_used_bytes",
    "gauge",
    "GPU memory held by the container's processes (namespace, pod and container empty: processes no container "
    "could be found for).",
    "namespace",
    "pod",
    "container",
    unit="bytes",
)
CONTAINER_SM_ACTIVE_SECONDS_TOTAL = _f(
    "gpuwarden_container_sm_active_seconds_total",
    "counter",
    "Seconds of SM utilization of the container's processes on the GPU (per-process SM utilization x window): "
    "rate() is the container's share of the GPU.",
    "namespace",
    "pod",
    "container",
    unit="seconds",
)
CONTAINER_PROCESSES = _f(
    "gpuwarden_container_processes",
    "gauge",
    "Processes of the container on the GPU (0 for a container allocated the GPU that runs none on it).",
    "namespace",
    "pod",
    "container",
)
# Slurm: the job holding the GPU, from its processes' cgroups (present only for processes inside a Slurm job step)
SLURM_JOB_GPU_MEMORY_USED_BYTES = _f(
    "gpuwarden_slurm_job_gpu_memory_used_bytes",
    "gauge",
    "GPU memory held by the Slurm job's processes on the GPU (job and user from the processes' cgroups).",
    "job",
    "user",
    unit="bytes",
)
SLURM_JOB_SM_ACTIVE_SECONDS_TOTAL = _f(
    "gpuwarden_slurm_job_sm_active_seconds_total",
    "counter",
    "Seconds of SM utilization of the Slurm job's processes on the GPU: rate() is the job's share of the GPU.",
    "job",
    "user",
    unit="seconds",
)
# jobs across GPUs (jobs/grouping.py, jobs/collective.py): `job_id` is the same on every node of a job where a
# launcher or Slurm set one (slurm/<id>, <namespace>/<MASTER_ADDR>:<port>[/<run id>]), else local/...; not `job`,
# which Prometheus keeps for the scrape job
JOB_COLLECTIVE_WAIT_SECONDS_TOTAL = _f(
    "gpuwarden_job_collective_wait_seconds_total",
    "counter",
    "Seconds the GPU's main process spent waiting for another rank of its job (GPUs of multi-GPU jobs only): all of "
    "a window in which it spins in a collective, the share of one in which it computes less than the job's slowest "
    "rank on this node (a partial wait); rate() is the share of time it waits.",
    "job_id",
    "rank",
    unit="seconds",
)
JOB_FINDING = _node(
    "gpuwarden_job_finding",
    "gauge",
    "1 while a job on this node has a straggler (kind=straggler: gpu, uuid and rank name it, cause says why), is "
    "hung in a collective (collective_hang), waits for a rank on another node (waiting_elsewhere), or has a rank the "
    "others have waited for since it began (imbalance: information, never a page).",
    "job_id",
    "kind",
    "gpu",
    "uuid",
    "rank",
    "cause",
)
JOB_IDENTITY_SOURCE_UP = _node(
    "gpuwarden_job_identity_source_up",
    "gauge",
    "1 where the job view's last read of this source of job identity worked, 0 where it could not read it: cgroup "
    "and cmdline (the host's /proc, other users' processes visible), environ (the same UID or CAP_SYS_PTRACE), "
    "pod_api (the pod's labels and spec; absent when off).",
    "source",
)
PROCESS_GPU_MEMORY_USED_BYTES = _f(
    "gpuwarden_process_gpu_memory_used_bytes",
    "gauge",
    "GPU memory held by one process (opt-in: processes.per_pid_series; the largest holders, processes."
    "max_pid_series per GPU).",
    "pid",
    "process_name",
    "namespace",
    "pod",
    "container",
    unit="bytes",
)
MIG_ALLOCATION = _f(
    "gpuwarden_mig_allocation",
    "gauge",
    "1 for each container the kubelet allocated a MIG slice of the GPU to; join the slice's gpuwarden_mig_gpm_* "
    "series with `* on(mig_uuid) group_left(namespace, pod, container)`.",
    "mig_uuid",
    "namespace",
    "pod",
    "container",
)
GPU_INFO = _f(
    "gpuwarden_gpu_info",
    "gauge",
    "Static identity of the GPU; always 1.",
    "name",
    "serial",
    "pci_bus_id",
    "vbios_version",
    "compute_capability",
)
GPU_UP = _f(
    "gpuwarden_gpu_up",
    "gauge",
    "1 when the GPU answers; 0 when it is lost (off the bus, reset required), also when it was lost before the "
    "exporter started (`uuid` as the kernel driver lists it, else `unknown-gpu-N`).",
)
GPU_STALE = _f(
    "gpuwarden_gpu_stale",
    "gauge",
    "1 when the GPU's last read overran the call deadline and its values are from an earlier poll.",
)
GPU_HARDWARE_ERROR_INFO = _f(
    "gpuwarden_gpu_hardware_error_info",
    "gauge",
    "A hardware error NVML reported for the GPU (corrupted InfoROM, IRQ issue, insufficient power).",
    "error",
)
# utilization
VIDEO_BUSY_SECONDS_TOTAL = _f(
    "gpuwarden_video_busy_seconds_total",
    "counter",
    "Seconds the video engine was busy (NVML's encoder or decoder utilization, integrated over each poll interval): "
    "rate() is its utilization (metrics group video).",
    "engine",
)
UTILIZATION_RATIO = _f(
    "gpuwarden_utilization_ratio",
    "gauge",
    "Share of the driver's last sample period (~200 ms on H100) in which a kernel ran; a point sample. "
    "Use rate(gpuwarden_busy_seconds_total) / rate(gpuwarden_utilization_sampled_seconds_total) for averages.",
    unit="ratio",
)
BUSY_SECONDS_TOTAL = _f(
    "gpuwarden_busy_seconds_total",
    "counter",
    "Seconds in which a kernel ran, summed from the driver's utilization sample buffer.",
    unit="seconds",
)
UTILIZATION_SAMPLED_SECONDS_TOTAL = _f(
    "gpuwarden_utilization_sampled_seconds_total",
    "counter",
    "Seconds covered by the utilization samples counted in gpuwarden_busy_seconds_total.",
    unit="seconds",
)
UTILIZATION_SOURCE_INFO = _f(
    "gpuwarden_utilization_source_info",
    "gauge",
    "Where utilization comes from: samples (driver sample buffer) or single_read (one read per poll; "
    "bursty load is misreported); always 1.",
    "source",
)
MEMORY_BANDWIDTH_UTILIZATION_RATIO = _f(
    "gpuwarden_memory_bandwidth_utilization_ratio",
    "gauge",
    "Share of the last sample period in which device memory was read or written (not occupancy).",
    unit="ratio",
)
# memory
MEMORY_TOTAL_BYTES = _f("gpuwarden_memory_total_bytes", "gauge", "Total device memory.", unit="bytes")
MEMORY_USED_BYTES = _f(
    "gpuwarden_memory_used_bytes",
    "gauge",
    "Device memory used by processes (v2: excludes the driver reserve).",
    unit="bytes",
)
MEMORY_FREE_BYTES = _f("gpuwarden_memory_free_bytes", "gauge", "Device memory free.", unit="bytes")
MEMORY_RESERVED_BYTES = _f(
    "gpuwarden_memory_reserved_bytes", "gauge", "Device memory reserved by the driver and firmware.", unit="bytes"
)
# thermal
TEMPERATURE_CELSIUS = _f("gpuwarden_temperature_celsius", "gauge", "GPU die temperature.", unit="celsius")
MEMORY_TEMPERATURE_CELSIUS = _f("gpuwarden_memory_temperature_celsius", "gauge", "HBM temperature.", unit="celsius")
TEMPERATURE_THRESHOLD_CELSIUS = _f(
    "gpuwarden_temperature_threshold_celsius",
    "gauge",
    "Temperature thresholds (absolute): slowdown, shutdown, gpu_max, memory_max.",
    "threshold",
    unit="celsius",
)
# power
POWER_USAGE_WATTS = _f(
    "gpuwarden_power_usage_watts", "gauge", "Power draw (1 s average on Ampere and newer).", unit="watts"
)
POWER_LIMIT_WATTS = _f("gpuwarden_power_limit_watts", "gauge", "Enforced power limit.", unit="watts")
POWER_DEFAULT_LIMIT_WATTS = _f(
    "gpuwarden_power_default_limit_watts", "gauge", "Default power limit of the board.", unit="watts"
)
ENERGY_JOULES_TOTAL = _f(
    "gpuwarden_energy_joules_total", "counter", "Energy consumed since the driver was loaded.", unit="joules"
)
# clocks and throttling
PERFORMANCE_STATE = _f(
    "gpuwarden_performance_state", "gauge", "Performance state: 0 = P0 (maximum) ... 15; omitted if unknown."
)
CLOCK_HERTZ = _f("gpuwarden_clock_hertz", "gauge", "Current clock.", "clock", unit="hertz")
CLOCK_MAX_HERTZ = _f("gpuwarden_clock_max_hertz", "gauge", "Maximum clock.", "clock", unit="hertz")
CLOCK_EVENT_ACTIVE = _f(
    "gpuwarden_clock_event_active",
    "gauge",
    "1 while the clock-event (throttle) reason is active at the poll; a point sample.",
    "reason",
)
THROTTLE_SECONDS_TOTAL = _f(
    "gpuwarden_throttle_seconds_total",
    "counter",
    "Cumulative time the driver held clocks down for the reason.",
    "reason",
    unit="seconds",
)
# ECC and memory health
ECC_ENABLED = _f("gpuwarden_ecc_enabled", "gauge", "1 when ECC is enabled (current mode).")
ECC_ERRORS_TOTAL = _f(
    "gpuwarden_ecc_errors_total", "counter", "ECC errors since the driver was loaded (volatile).", "type"
)
ECC_LIFETIME_ERRORS_TOTAL = _f(
    "gpuwarden_ecc_lifetime_errors_total",
    "counter",
    "ECC errors over the board's life (InfoROM aggregate).",
    "type",
)
REMAPPED_ROWS = _f("gpuwarden_remapped_rows", "gauge", "Memory rows remapped, by cause (Ampere and newer).", "cause")
REMAPPED_ROWS_PENDING = _f(
    "gpuwarden_remapped_rows_pending", "gauge", "1 when a row remap is pending (reset the GPU to apply)."
)
REMAPPED_ROWS_FAILED = _f("gpuwarden_remapped_rows_failed", "gauge", "1 when a row remap failed (replace the GPU).")
RETIRED_PAGES = _f("gpuwarden_retired_pages", "gauge", "Retired memory pages, by cause (pre-Ampere).", "cause")
RETIRED_PAGES_PENDING = _f(
    "gpuwarden_retired_pages_pending", "gauge", "1 when a page retirement is pending (pre-Ampere)."
)
# XID
XID_ERRORS_TOTAL = _f(
    "gpuwarden_xid_errors_total",
    "counter",
    "XID critical errors: NVML's events since this exporter started or, where the kernel log is read "
    "(nvml.kernel_log), its XID lines since boot, whichever counts more.",
    "xid",
)
XID_LAST_TIMESTAMP_SECONDS = _f(
    "gpuwarden_xid_last_timestamp_seconds",
    "gauge",
    "Unix time of the last event of each XID.",
    "xid",
    unit="seconds",
)
# the kernel log (nvml.kernel_log): what NVML does not report
KERNEL_SXID_ERRORS_TOTAL = _node(
    "gpuwarden_kernel_sxid_errors_total",
    "counter",
    "NVSwitch SXid errors in the kernel log since boot, by switch (its PCI address) and SXid.",
    "switch",
    "sxid",
)
KERNEL_SXID_LAST_TIMESTAMP_SECONDS = _node(
    "gpuwarden_kernel_sxid_last_timestamp_seconds",
    "gauge",
    "Unix time of the latest kernel log record of each SXid, by switch.",
    "switch",
    "sxid",
    unit="seconds",
)
KERNEL_FALLEN_OFF_BUS_TOTAL = _f(
    "gpuwarden_kernel_fallen_off_bus_total",
    "counter",
    "The driver's 'GPU has fallen off the bus' records in the kernel log since boot (XID 79's among them).",
)
KERNEL_LOG_UP = _node(
    "gpuwarden_kernel_log_up",
    "gauge",
    "1 while the kernel log (nvml.kernel_log) is read, 0 while it cannot be (no /dev/kmsg, no permission, no relay "
    "writing into the pipe) or the host's GPUs are not known yet; absent when no kernel log is read.",
)
KERNEL_LOG_LINES_IGNORED_TOTAL = _node(
    "gpuwarden_kernel_log_lines_ignored_total",
    "counter",
    "Kernel log lines naming the NVIDIA driver that count for nothing, by reason: user_facility (not logged by "
    "the kernel), not_driver (driver text inside another record, e.g. a process's crash report naming its file), "
    "unknown_device (none of this host's GPUs or NVSwitches), unparsed, too_long, table_full; no series until "
    "one is.",
    "reason",
)
# modes, processes, recovery
PERSISTENCE_MODE_ENABLED = _f("gpuwarden_persistence_mode_enabled", "gauge", "1 when persistence mode is on.")
MIG_MODE_ENABLED = _f("gpuwarden_mig_mode_enabled", "gauge", "1 when MIG mode is on (current mode).")
PROCESSES = _f("gpuwarden_processes", "gauge", "Compute processes running on the GPU.")
RECOVERY_ACTION = _f(
    "gpuwarden_recovery_action",
    "gauge",
    "The driver's recommended recovery action: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset.",
)
# PCIe
PCIE_REPLAY_ERRORS_TOTAL = _f("gpuwarden_pcie_replay_errors_total", "counter", "PCIe replay counter.")
PCIE_BYTES_TOTAL = _f(
    "gpuwarden_pcie_bytes_total",
    "counter",
    "PCIe link bytes by direction, TLP headers and framing included (+6-7 % over the payload at 256-byte max "
    "payload, measured on H100): from GPM's PCIe rates where the GPU has GPM, else the driver counters (R555+).",
    "direction",
    unit="bytes",
)
PCIE_LINK_GENERATION = _f("gpuwarden_pcie_link_generation", "gauge", "PCIe link generation.", "kind")
PCIE_LINK_WIDTH = _f("gpuwarden_pcie_link_width", "gauge", "PCIe link width (lanes).", "kind")
FAN_SPEED_RATIO = _f(
    "gpuwarden_fan_speed_ratio", "gauge", "Fan speed as a share of maximum (may exceed 1).", unit="ratio"
)
# NVLink and topology
NVLINK_ACTIVE_LINKS = _f(
    "gpuwarden_nvlink_active_links",
    "gauge",
    "NVLink links of the GPU that are active (a drop means a link went down; per link: group nvlink_links).",
)
NVLINK_LINKS = _f(
    "gpuwarden_nvlink_links",
    "gauge",
    "NVLink links the GPU has (static, from NVML): GpuwardenNvlinkDown compares gpuwarden_nvlink_active_links with it.",
)
NVLINK_GPU_ERRORS_TOTAL = _f(
    "gpuwarden_nvlink_gpu_errors_total",
    "counter",
    "NVLink errors of all the GPU's links, by type (crc_flit, crc_data, replay, recovery, ecc; per link: group "
    "nvlink_links).",
    "type",
)
NVLINK_UP = _f("gpuwarden_nvlink_up", "gauge", "1 when the NVLink link is active.", "link")
NVLINK_ERRORS_TOTAL = _f("gpuwarden_nvlink_errors_total", "counter", "NVLink errors per link.", "link", "type")
NVLINK_PEER_LINKS = _f(
    "gpuwarden_nvlink_peer_links",
    "gauge",
    "Active NVLinks to the peer GPU (NV# in nvidia-smi topo -m).",
    "peer_gpu",
    "peer_uuid",
)
TOPOLOGY_INFO = _f(
    "gpuwarden_topology_info",
    "gauge",
    "Connection to the peer GPU as nvidia-smi topo -m shows it (NV#, PIX, PXB, PHB, NODE, SYS); always 1.",
    "peer_gpu",
    "level",
)


# -- collector groups: detail that is off by default, so an 8-GPU node stays within its series budget ------------
# Everything a group holds stays in the JSON API; groups only decide what /metrics exports. A member is a whole
# family, or the rows of a family whose label (or value) matches.


@dataclass(frozen=True)
class Member:
    """A family, or some of its rows, that belongs to a collector group."""

    family: Family
    label: str | None = None  # None: the whole family
    values: frozenset[str] = frozenset()  # the label's values this group holds (fnmatch globs allowed)
    excluded: frozenset[str] = frozenset()  # or: every value of the label but these
    zero_rows: bool = False  # the rows whose value is 0 (gpuwarden_health's ok checks)

    def holds(self, labels: list[str], value: float) -> bool:
        if self.zero_rows:
            return value == 0
        if self.label is None:
            return True
        position = self.family.all_labels.index(self.label)
        current = labels[position]
        if self.excluded:
            return current not in self.excluded
        if any(v.endswith("*") for v in self.values):
            return any(fnmatch(current, v) for v in self.values)
        return current in self.values


@dataclass(frozen=True)
class Group:
    """An opt-in collector group: its name, what it adds, and its members."""

    name: str
    description: str
    members: tuple[Member, ...]


# throttle time kept by default: the reasons the alerts watch, thermal slowdown and the board's power limit
THROTTLE_DETAIL_REASONS = frozenset({"sync_boost", "low_utilization", "reliability", "thermal_policy"})
GROUPS: dict[str, Group] = {
    g.name: g
    for g in (
        Group(
            "nvlink_links",
            "Per-link NVLink state and error counters (18 links x 6 series per H100). Default: per-GPU "
            "gpuwarden_nvlink_active_links and gpuwarden_nvlink_gpu_errors_total{type}.",
            (Member(NVLINK_UP), Member(NVLINK_ERRORS_TOTAL)),
        ),
        Group(
            "topology",
            "The GPU matrix as series (gpuwarden_topology_info, gpuwarden_nvlink_peer_links: 7 per GPU on 8 GPUs). "
            "Default: /api/v1/topology.",
            (Member(TOPOLOGY_INFO), Member(NVLINK_PEER_LINKS)),
        ),
        Group(
            "health_checks",
            "gpuwarden_health for checks that are ok (0). Default: only checks at warning or critical, plus "
            "gpuwarden_health_status per GPU.",
            (Member(HEALTH, zero_rows=True),),
        ),
        Group(
            "clocks_detail",
            "Clock-event point samples, maximum clocks, the memory and graphics clocks, and throttle time for "
            "sync_boost, low_utilization, reliability and thermal_policy. Default: the SM clock and throttle seconds "
            "for sw_power_cap, board_limit, sw/hw thermal slowdown and the power brake.",
            (
                Member(CLOCK_EVENT_ACTIVE),
                Member(CLOCK_MAX_HERTZ),
                Member(CLOCK_HERTZ, "clock", frozenset({"memory", "graphics"})),
                Member(THROTTLE_SECONDS_TOTAL, "reason", THROTTLE_DETAIL_REASONS),
            ),
        ),
        Group(
            "point_samples",
            "Gauges whose exact average is a default counter: utilization ratio and source, memory-bandwidth "
            "ratio, instantaneous power (use gpuwarden_busy_seconds_total, gpuwarden_energy_joules_total).",
            (
                Member(UTILIZATION_RATIO),
                Member(UTILIZATION_SOURCE_INFO),
                Member(MEMORY_BANDWIDTH_UTILIZATION_RATIO),
                Member(POWER_USAGE_WATTS),
            ),
        ),
        Group(
            "memory_detail",
            "Free and driver-reserved memory, ECC mode, lifetime ECC counters and remapped rows by cause.",
            (
                Member(MEMORY_FREE_BYTES),
                Member(MEMORY_RESERVED_BYTES),
                Member(ECC_ENABLED),
                Member(ECC_LIFETIME_ERRORS_TOTAL),
                Member(REMAPPED_ROWS),
            ),
        ),
        Group(
            "gpm_detail",
            "GPM graphics-engine activity, warp occupancy and the FP64/FP32/FP16 pipes. Default: SM, tensor, DRAM, "
            "PCIe and NVLink.",
            (
                Member(GPM_GRAPHICS_ACTIVE_SECONDS_TOTAL),
                Member(GPM_SM_OCCUPANCY_SECONDS_TOTAL),
                Member(GPM_PIPE_ACTIVE_SECONDS_TOTAL, "pipe", frozenset({"fp64", "fp32", "fp16"})),
            ),
        ),
        Group(
            "static_detail",
            "Static facts: PCIe link generation and width, MIG mode, fan, the temperature thresholds other than "
            "memory_max (in /api/v1/gpus either way).",
            (
                Member(PCIE_LINK_GENERATION),
                Member(PCIE_LINK_WIDTH),
                Member(MIG_MODE_ENABLED),
                Member(FAN_SPEED_RATIO),
                Member(TEMPERATURE_THRESHOLD_CELSIUS, "threshold", excluded=frozenset({"memory_max"})),
            ),
        ),
        Group(
            "video",
            "Encoder and decoder utilization as busy seconds (gpuwarden_video_busy_seconds_total{engine}): for "
            "transcoding and video inference nodes; its NVML reads run only with the group on.",
            (Member(VIDEO_BUSY_SECONDS_TOTAL),),
        ),
        Group(
            "fabric_detail",
            "Every NVSwitch fabric state and health condition, the completed and false ones too, and "
            "gpuwarden_fabric_info (clique, cluster, health summary). Default: only a fabric that is not set up or "
            "a condition that holds.",
            (
                Member(FABRIC_STATE, "state", frozenset({"completed"})),
                Member(FABRIC_STATE, zero_rows=True),  # the states the GPU is not in
                Member(FABRIC_HEALTH, zero_rows=True),
                Member(FABRIC_INFO),
            ),
        ),
        Group(
            "container_detail",
            "Processes per container (gpuwarden_container_processes); memory and SM per container are default.",
            (Member(CONTAINER_PROCESSES),),
        ),
        Group(
            "unsupported_fields",
            "gpuwarden_collect_errors_total for driver fields a GPU does not support (found once at start, "
            "field_*, not_supported): one series per field.",
            (Member(COLLECT_ERRORS_TOTAL, "call", frozenset({"field_*"})),),
        ),
    )
}


class Selection:
    """What /metrics exports: the include/exclude globs per family, then the collector groups per row."""

    def __init__(
        self,
        include: tuple[str, ...] = (),
        exclude: tuple[str, ...] = (),
        enable: tuple[str, ...] = (),
    ) -> None:
        self.family = family_filter(include, exclude)
        off = [g for g in GROUPS.values() if g.name not in enable]  # every group is opt-in
        self._whole = {m.family.name for g in off for m in g.members if m.label is None and not m.zero_rows}
        self._partial: dict[str, list[Member]] = {}
        for group in off:
            for member in group.members:
                if member.label is not None or member.zero_rows:
                    self._partial.setdefault(member.family.name, []).append(member)

    def __call__(self, name: str) -> bool:
        return self.family(name) and name not in self._whole

    def rows(self, name: str) -> Callable[[list[str], float], bool] | None:
        """A predicate keeping a family's rows, or None to keep them all."""
        members = self._partial.get(name)
        if not members:
            return None
        return lambda labels, value: not any(m.holds(labels, value) for m in members)


def family_filter(include: tuple[str, ...], exclude: tuple[str, ...]) -> Callable[[str], bool]:
    """A predicate for metric names from the `metrics.include` / `metrics.exclude` globs."""

    def wanted(name: str) -> bool:
        if include and not any(fnmatch(name, pattern) for pattern in include):
            return False
        return not any(fnmatch(name, pattern) for pattern in exclude)

    return wanted
