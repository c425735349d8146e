"""Profiling-class activity from NVML GPM (fast tier): SM, occupancy, tensor and FP pipes, DRAM, NVLink bytes.

Each fast poll takes one GPM sample (at least 100 ms apart) on the GPU's own worker thread, which alone owns its
sample buffers (exporter/nvml/gpm.py says why); the metrics over the window between two samples are accumulated as
activity × seconds, so `rate()` of each counter over any range divided by the rate of
`gpuwarden_gpm_window_seconds_total` is the true mean. A GPU without GPM (pre-Hopper) has no profiling series and
one `collect_errors` entry, and is not asked again until re-discovery; NO_PERMISSION logs one line naming the cause
and fix, and `gpuwarden_gpm_unavailable_info{reason}` says so. Measured cost on H200: ~2.4 millicores per GPU at 1 s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from exporter.metrics import (
    GPM_DRAM_ACTIVE_SECONDS_TOTAL,
    GPM_GRAPHICS_ACTIVE_SECONDS_TOTAL,
    GPM_PIPE_ACTIVE_SECONDS_TOTAL,
    GPM_SM_ACTIVE_SECONDS_TOTAL,
    GPM_SM_OCCUPANCY_SECONDS_TOTAL,
    GPM_UNAVAILABLE_INFO,
    GPM_WINDOW_SECONDS_TOTAL,
    NVLINK_BYTES_TOTAL,
    PCIE_BYTES_TOTAL,
)
from exporter.nvml import calls as nvml
from exporter.nvml.device import GpuDevice
from exporter.nvml.gpm import NOT_SUPPORTED_REASON, GpmUnavailable, GpmWindow, Window, check_support
from exporter.readers import Reader
from exporter.snapshot import SampleWriter, Tier

log = logging.getLogger(__name__)
MIB = 1024 * 1024

# metric id → (counter key, share per unit: percent → ratio, MiB/s → bytes/s)
METRICS: dict[int, tuple[str, float]] = {
    nvml.NVML_GPM_METRIC_GRAPHICS_UTIL: ("graphics", 0.01),
    nvml.NVML_GPM_METRIC_SM_UTIL: ("sm", 0.01),
    nvml.NVML_GPM_METRIC_SM_OCCUPANCY: ("occupancy", 0.01),
    nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: ("tensor", 0.01),
    nvml.NVML_GPM_METRIC_FP64_UTIL: ("fp64", 0.01),
    nvml.NVML_GPM_METRIC_FP32_UTIL: ("fp32", 0.01),
    nvml.NVML_GPM_METRIC_FP16_UTIL: ("fp16", 0.01),
    nvml.NVML_GPM_METRIC_DRAM_BW_UTIL: ("dram", 0.01),
    nvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: ("pcie_rx", MIB),
    nvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: ("pcie_tx", MIB),
    nvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: ("nvlink_rx", MIB),
    nvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: ("nvlink_tx", MIB),
}


@dataclass
class GpmState:
    """One GPU's GPM: its window (sample buffers), the metrics that answer, and the accumulated totals."""

    window: GpmWindow | None = None
    unavailable: str | None = None
    metric_ids: list[int] = field(default_factory=lambda: list(METRICS))
    totals: dict[str, float] = field(default_factory=dict)


def _state(dev: GpuDevice) -> GpmState:
    state: GpmState | None = dev.state.get("gpm")
    if state is None:
        state = dev.state["gpm"] = GpmState()
    if state.window is not None and state.window.handle is not dev.handle:
        state.window.free()  # re-discovered (a reset, a driver re-init): new handle, new buffers, a new window
        state.window, state.unavailable = None, None
    return state


def _open(dev: GpuDevice, state: GpmState) -> None:
    try:
        check_support(dev.handle)
        state.window = GpmWindow(dev.handle)
    except GpmUnavailable as exc:
        _unavailable(dev, state, exc.reason)


def _unavailable(dev: GpuDevice, state: GpmState, reason: str) -> None:
    if state.window is not None:
        state.window.free()
    state.window, state.unavailable = None, reason
    dev.ledger.error("nvmlGpmQueryDeviceSupport", reason)
    if reason == "no_permission":
        log.warning(
            "gpu %s: GPM profiling answers no_permission: the driver restricts profiling to admins "
            "(RmProfilingAdminOnly=1 in /proc/driver/nvidia/params); set NVreg_RestrictProfilingToAdminUsers=0 or "
            "run gpuwarden with CAP_SYS_ADMIN; profiling series are omitted",
            dev.index,
        )
    elif reason != NOT_SUPPORTED_REASON:
        log.warning("gpu %s: GPM unavailable (%s); profiling series are omitted", dev.index, reason)


def serves_pcie_bytes(dev: GpuDevice) -> bool:
    """True while GPM reads this GPU: then gpuwarden_pcie_bytes_total comes from GPM's PCIe rates, not from the
    driver's byte-counter fields 197/198, which counted 0.78 GB of 367 GB copied host→device on an H100 (driver
    580.159.04, docs/validation/2026-11-26-h100-profiling): one source per quantity, the one that was measured true."""
    state: GpmState | None = dev.state.get("gpm")
    return state is not None and state.window is not None


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    state = _state(dev)
    if state.window is None and state.unavailable is None:
        _open(dev, state)
    if state.window is None:
        if state.unavailable not in (None, NOT_SUPPORTED_REASON):
            out.add(GPM_UNAVAILABLE_INFO, 1, state.unavailable)
        return
    try:
        window = state.window.advance(state.metric_ids)
    except GpmUnavailable as exc:
        _unavailable(dev, state, exc.reason)
        return
    if window is not None:
        _accumulate(dev, state, window)
    _write(state.totals, out)


def _accumulate(dev: GpuDevice, state: GpmState, window: Window) -> None:
    seconds = window.seconds
    for metric, error in window.failed.items():
        if metric in state.metric_ids:  # a metric this driver does not serve: dropped for this GPU, counted once
            state.metric_ids.remove(metric)
            dev.ledger.error(f"gpm_metric_{metric}", error)
    totals = state.totals
    totals["window"] = totals.get("window", 0.0) + seconds
    for metric, value in window.values.items():
        key, scale = METRICS[metric]
        totals[key] = totals.get(key, 0.0) + max(value, 0.0) * scale * seconds


def _write(totals: dict[str, float], out: SampleWriter) -> None:
    if "window" not in totals:
        return
    out.add(GPM_WINDOW_SECONDS_TOTAL, totals["window"])
    out.add(GPM_GRAPHICS_ACTIVE_SECONDS_TOTAL, totals.get("graphics"))
    out.add(GPM_SM_ACTIVE_SECONDS_TOTAL, totals.get("sm"))
    out.add(GPM_SM_OCCUPANCY_SECONDS_TOTAL, totals.get("occupancy"))
    for pipe in ("tensor", "fp64", "fp32", "fp16"):
        out.add(GPM_PIPE_ACTIVE_SECONDS_TOTAL, totals.get(pipe), pipe)
    out.add(GPM_DRAM_ACTIVE_SECONDS_TOTAL, totals.get("dram"))
    out.add(PCIE_BYTES_TOTAL, totals.get("pcie_rx"), "rx")
    out.add(PCIE_BYTES_TOTAL, totals.get("pcie_tx"), "tx")
    out.add(NVLINK_BYTES_TOTAL, totals.get("nvlink_rx"), "rx")
    out.add(NVLINK_BYTES_TOTAL, totals.get("nvlink_tx"), "tx")


FAST = Reader(
    "gpm",
    Tier.FAST,
    (
        GPM_WINDOW_SECONDS_TOTAL,
        GPM_GRAPHICS_ACTIVE_SECONDS_TOTAL,
        GPM_SM_ACTIVE_SECONDS_TOTAL,
        GPM_SM_OCCUPANCY_SECONDS_TOTAL,
        GPM_PIPE_ACTIVE_SECONDS_TOTAL,
        GPM_DRAM_ACTIVE_SECONDS_TOTAL,
        NVLINK_BYTES_TOTAL,
        PCIE_BYTES_TOTAL,
        GPM_UNAVAILABLE_INFO,
    ),
    read_fast,
)
