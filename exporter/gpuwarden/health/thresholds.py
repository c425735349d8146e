"""Every health threshold, defined once.

The exporter's health gauges (exporter/gpuwarden/health/checks.py) and the Prometheus alert rules
(exporter/gpuwarden/health/rules.py → alert_rules/gpuwarden.rules.yaml) are both derived from this model;
tests/test_alert_rules.py fails when the committed rules drift from it. Operators override values with a YAML file
(`health.thresholds_file`); unknown keys or out-of-range values are rejected with one line, like the rest of the
configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpuwarden.config.settings import ConfigError, read_yaml
from gpuwarden.config.typed import SettingError, build, setting


@dataclass(frozen=True)
class Thresholds:
    """Every health threshold and duration, with its default; operators override them by file."""

    # utilization: a job holds the GPU but kernels run less than this share of the time
    utilization_low_ratio: float = setting(0.5, gt=0, lt=1)
    utilization_for_s: int = setting(1800, ge=1)
    # memory occupancy (used / total): a warning once over memory_warning_ratio for memory_for_s, or at once past
    # memory_critical_ratio (still a warning, as the alert: a full GPU is the job's problem, not a page)
    memory_warning_ratio: float = setting(0.95, gt=0, lt=1)
    memory_critical_ratio: float = setting(0.99, gt=0, le=1)
    memory_for_s: int = setting(900, ge=0)
    # die temperature, absolute °C
    temperature_warning_celsius: float = setting(83, gt=0, lt=120)
    temperature_warning_for_s: int = setting(300, ge=0)
    temperature_critical_celsius: float = setting(90, gt=0, lt=130)
    temperature_critical_for_s: int = setting(120, ge=0)
    # HBM temperature: within this many °C of the board's own memory_max threshold
    memory_temperature_margin_celsius: float = setting(5, ge=0, le=30)
    memory_temperature_for_s: int = setting(300, ge=0)
    # share of time the clocks were held down, from gpuwarden_throttle_seconds_total
    thermal_slowdown_ratio: float = setting(0.1, gt=0, le=1)
    thermal_slowdown_for_s: int = setting(300, ge=0)
    # sustained thermal throttling is critical (the exporter's verdict and the page, GpuwardenThermalThrottling): HW or
    # SW thermal slowdown for more than this share of the window, that long
    thermal_page_ratio: float = setting(0.5, gt=0, le=1)
    thermal_page_window_s: int = setting(600, ge=60)
    thermal_page_for_s: int = setting(600, ge=0)
    power_brake_ratio: float = setting(0.1, gt=0, le=1)
    power_cap_ratio: float = setting(0.5, gt=0, le=1)
    power_cap_for_s: int = setting(1800, ge=0)
    power_limit_reduced_for_s: int = setting(3600, ge=0)
    # P-state: a busy GPU held at this state or lower performance (higher number)
    pstate_degraded_min: int = setting(2, ge=1, le=15)
    pstate_busy_ratio: float = setting(0.5, gt=0, lt=1)
    pstate_for_s: int = setting(900, ge=1)
    # CUDA runs GeForce/Quadro/TITAN boards in P2 by design ("CUDA - Force P2 State"): not a degradation there
    pstate_exempt_name_regex: str = ".*(GeForce|Quadro|TITAN).*"
    # XIDs (docs/alerting.md, XIDs): a critical XID seen within the window
    xid_window_s: int = setting(600, ge=1)  # warning XIDs
    # a critical XID pages once, xid_critical_for_s after it (longer than gpu_lost_for_s, so a GPU that falls off
    # the bus pages as lost alone: GpuwardenGpuLost inhibits it), and its page resolves xid_window_s after the last
    # one, as the exporter's verdict does (below Alertmanager's 1 h repeat: a page resolved in PagerDuty is not
    # re-opened); the node stays a cordon candidate for xid_critical_hold_s (the fleet view), judged over
    # Prometheus' history, so a restarted exporter forgets neither
    xid_critical_for_s: int = setting(120, ge=0)
    xid_critical_hold_s: int = setting(86400, ge=600)
    # where no expected GPU count is configured, a node remembers its GPU count this long (by node, across restarts)
    gpu_count_memory_s: int = setting(86400, ge=3600)
    xid_critical: tuple[int, ...] = (
        46,
        48,
        54,
        62,
        64,
        74,
        79,
        95,
        109,
        110,
        119,
        120,
        136,
        140,
        143,
        144,
        145,
        146,
        147,
        148,
        149,
        150,
        155,
        156,
        158,
    )
    xid_warning: tuple[int, ...] = (61, 94)
    xid_info: tuple[int, ...] = (63, 92)
    # NVLink and PCIe
    nvlink_down_for_s: int = setting(300, ge=0)
    nvlink_crc_per_second: float = setting(100, gt=0)
    nvlink_crc_for_s: int = setting(600, ge=0)
    # an NVSwitch fabric not set up this long is a fault (Fabric Manager sets it up within a minute or two of boot:
    # the exporter starting with the node must not call the first minutes critical); degraded bandwidth, a route
    # recovering or an access timeout recovering this long is a warning
    fabric_setup_for_s: int = setting(300, ge=0)
    fabric_degraded_for_s: int = setting(300, ge=0)
    pcie_replays_per_minute: float = setting(8, gt=0)
    pcie_replays_for_s: int = setting(600, ge=0)
    # configuration and availability
    persistence_off_for_s: int = setting(900, ge=0)
    gpu_lost_for_s: int = setting(60, ge=0)
    # a page for a lasting fault (lost GPU, NVLink down, ECC, row remapping, heat, fabric, recovery action) holds this
    # long without a reading before it resolves: an exporter restart (the same instance after a gap, or a new pod and
    # instance) must not resolve it; a repaired fault's page resolves this long after its last faulty reading
    page_hold_s: int = setting(300, ge=0)
    retired_pages_limit: int = setting(63, ge=1)
    # bottleneck classes from GPM activity (information, never paged), judged over this window
    bottleneck_window_s: int = setting(300, ge=1)
    bottleneck_tensor_ratio: float = setting(0.3, gt=0, le=1)  # tensor cores active at least this share: healthy
    # mixed precision sits at 20-40 % tensor (bf16 transformer on H100: tensor 22 %, FP32 2 %): the tensor pipe
    # dominates when it is at least this share and this many times the FP32 pipe's
    bottleneck_tensor_min_ratio: float = setting(0.1, gt=0, le=1)
    bottleneck_pipe_dominance: float = setting(2.0, ge=1)
    # "busy but SMs nearly idle": the driver counts a kernel running while the SMs barely work (a Python loop of
    # tiny kernels on H100: driver busy 31 %, SM 0 %; tiny-batch decode loops on H200: busy 15 %, SM 2 %, and busy
    # 36 %, SM 12 %): launch overhead. Kernels that fill the GPU keep SM activity near the busy ratio (bf16
    # training on H200: SM 87 % at busy 99 %), so SMs under half of busy are kernels too small for the GPU
    bottleneck_launch_busy_ratio: float = setting(0.1, gt=0, le=1)
    bottleneck_launch_sm_share: float = setting(0.5, gt=0, le=1)  # SM activity below this share of driver busy
    bottleneck_dram_ratio: float = setting(0.6, gt=0, le=1)  # device-memory bandwidth at least this share
    bottleneck_sm_busy_ratio: float = setting(0.5, gt=0, le=1)  # SMs busy, without tensor cores: FP32 math
    bottleneck_sm_idle_ratio: float = setting(0.3, gt=0, le=1)  # SMs below this: waiting on something
    bottleneck_nvlink_bytes_per_second: float = setting(10e9, gt=0)  # NVLink traffic that means communication
    bottleneck_pcie_bytes_per_second: float = setting(5e9, gt=0)  # PCIe traffic (either way) that means transfers
    # PCIe traffic with the SMs idle (under bottleneck_copy_sm_ratio) and no math: a loop that only copies, however
    # slowly the host side lets it (device-to-host into pageable memory on H200: 1.6 GB/s, busy 5 %, SM 0 %: the
    # driver stages each copy through a pinned buffer on the CPU)
    bottleneck_copy_only_bytes_per_second: float = setting(0.5e9, gt=0)
    bottleneck_copy_sm_ratio: float = setting(0.02, gt=0, le=1)
    # FP32 training is told to use bf16 only where the FP32 pipe carries this share (FP32 matmul on H100: 77 %);
    # a bf16 LayerNorm + softmax job reads FP32 22 % with SMs at 99 %: fusion, not bf16, is its advice
    bottleneck_fp32_ratio: float = setting(0.4, gt=0, le=1)
    # NVLink traffic this heavy with the math pipes idle is communication even while NCCL's kernels keep the SMs
    # 30-60 % active (DDP with 2 GB of gradients a step on 2x H200: SM 46-48 %, NVLink 117-122 GB/s per GPU)
    bottleneck_nvlink_busy_bytes_per_second: float = setting(50e9, gt=0)
    # jobs across GPUs (jobs/collective.py): judged over a window short enough to name a straggler within 60 s
    collective_window_s: int = setting(20, ge=5, le=600)
    # a rank spinning in a collective: driver busy at least this share (waiters measured at 85-99 %; single-GPU
    # tiny kernels, the launch-bound look-alike, at 28-31 %), SMs no busier than NCCL's CTAs (one per channel,
    # 17-24 % measured at the default channel counts; 32 channels on 132 SMs is 24 %), math pipes below this
    collective_busy_ratio: float = setting(0.6, gt=0, le=1)
    collective_sm_ratio: float = setting(0.35, gt=0, le=1)
    collective_math_ratio: float = setting(0.05, gt=0, le=1)
    # ...and device memory below this share (waiters on H200: DRAM 4-10 %; decode replicas, busy with few tensor
    # cycles, 40-70 %)
    collective_dram_ratio: float = setting(0.2, gt=0, le=1)
    # partial waits: a rank whose math pipes carry at least this share less than its job's busiest rank's (and is
    # busy: spinning the rest) waits that share of each step for it; read where the busiest rank's math pipes are
    # at least collective_partial_math_ratio (below, a percent of noise is a large share). A rank 1.2x slower
    # leaves its peers 17 % of each step
    collective_partial_wait_ratio: float = setting(0.15, gt=0, lt=1)
    collective_partial_math_ratio: float = setting(0.1, gt=0, le=1)
    # a job's usual waits: each rank's lowest wait share over the windows in which the job computed, this long; a
    # straggler without a measured cause is named only where its peers wait collective_partial_wait_ratio more than
    # that (an onset): a pipeline's built-in imbalance and a warm-up's skew have none
    collective_baseline_s: int = setting(3600, ge=60)
    # no progress: every path the job's data may take (NVLink, PCIe, the host's RDMA ports) carries less than this
    collective_hang_bytes_per_second: float = setting(1e7, gt=0)
    # a straggler is named once the job's GPUs have disagreed this long (a checkpoint written by rank 0 between
    # steps is shorter); links that have carried nothing this long while ranks spin make it a hang. On 2x H200 a
    # CPU-bound rank 0 (0.3 s a step) showed in a 20 s window's classes 25 s after the onset: window 20 s and 10 s
    # of disagreement name it within the 60 s asked
    collective_straggler_for_s: int = setting(10, ge=0)
    # ... or this long where the host corroborates: the named rank's own main process is measured on the CPU, in its
    # input workers or in I/O (two independent sources agree). The recorded 2x H200 stragglers of these causes were
    # named 26-30 s after the onset; 10 s of disagreement named two of them 2 and 6 s later than that
    collective_straggler_corroborated_for_s: int = setting(4, ge=0)
    collective_hang_for_s: int = setting(60, ge=0)
    # the exporter itself
    exporter_down_for_s: int = setting(300, ge=0)
    exporter_absent_for_s: int = setting(900, ge=0)
    nvml_down_for_s: int = setting(300, ge=0)
    collection_stale_s: int = setting(300, ge=1)

    def validate(self) -> None:
        """Checks across fields (typedconfig.build runs it last)."""
        if self.temperature_critical_celsius <= self.temperature_warning_celsius:
            raise ValueError("temperature_critical_celsius must be above temperature_warning_celsius")
        if self.memory_critical_ratio <= self.memory_warning_ratio:
            raise ValueError("memory_critical_ratio must be above memory_warning_ratio")
        lists = [set(self.xid_critical), set(self.xid_warning), set(self.xid_info)]
        if lists[0] & lists[1] or lists[0] & lists[2] or lists[1] & lists[2]:
            raise ValueError("xid_critical, xid_warning and xid_info must not share an XID")
        if self.xid_critical_for_s and self.xid_critical_for_s <= self.gpu_lost_for_s:
            raise ValueError(
                "xid_critical_for_s must be above gpu_lost_for_s (or 0), so that a GPU that falls off the bus pages "
                "once, as lost"
            )
        if self.xid_critical_for_s >= self.xid_window_s:
            raise ValueError("xid_critical_for_s must be below xid_window_s, or a critical XID never pages")


DEFAULT = Thresholds()


def load_thresholds(path: Path | None, flag: str = "health.thresholds_file") -> Thresholds:
    """Defaults, overridden by a YAML mapping of the fields above; ConfigError (one line, naming `flag`) on a bad
    file."""
    if path is None:
        return DEFAULT
    try:
        return build(Thresholds, read_yaml(path, "thresholds file", flag))
    except SettingError as exc:
        raise ConfigError(exc.line(f"thresholds file {path}")) from None
