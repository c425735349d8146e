"""Profiling-class activity from NVML GPM (fast tier): SM, occupancy, tensor and FP pipes, DRAM, NVLink bytes.

Each fast poll takes one GPM sample (at least 100 ms apart) through the GPM sampler, by default a supervised child
process that owns every sample buffer and makes one GPM call at a time (exporter/gpuwarden/nvml/gpm_sampler.py says
why); a sampler that crashed reports `gpuwarden_gpm_unavailable_info{reason="crashed"}` and counts
`gpuwarden_collect_errors_total{call="gpm_sampler"}`, while every other family is served. The metrics over the
window between two samples are accumulated as
activity × seconds, so `rate()` of each counter over any range divided by the rate of
`gpuwarden_gpm_window_seconds_total` is the true mean. A GPU without GPM (pre-Hopper) has no profiling series and
one `collect_errors` entry, and is not asked again until re-discovery; NO_PERMISSION logs one line naming the cause
and fix, and `gpuwarden_gpm_unavailable_info{reason}` says so. On a MIG-enabled GPU each GPU instance the slow tier
found is sampled too (nvmlGpmMigSampleGet, its own window), as gpuwarden_mig_gpm_* with the slice's `mig_uuid`.
Measured cost on H200: ~2.4 millicores per GPU at 1 s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from gpuwarden.collect.reader import Reader
from gpuwarden.model.families import (
    GPM_DRAM_ACTIVE_SECONDS_TOTAL,
    GPM_GRAPHICS_ACTIVE_SECONDS_TOTAL,
    GPM_PIPE_ACTIVE_SECONDS_TOTAL,
    GPM_SM_ACTIVE_SECONDS_TOTAL,
    GPM_SM_OCCUPANCY_SECONDS_TOTAL,
    GPM_UNAVAILABLE_INFO,
    GPM_WINDOW_SECONDS_TOTAL,
    MIG_GPM_DRAM_ACTIVE_SECONDS_TOTAL,
    MIG_GPM_GRAPHICS_ACTIVE_SECONDS_TOTAL,
    MIG_GPM_PIPE_ACTIVE_SECONDS_TOTAL,
    MIG_GPM_SM_ACTIVE_SECONDS_TOTAL,
    MIG_GPM_WINDOW_SECONDS_TOTAL,
    NVLINK_BYTES_TOTAL,
    PCIE_BYTES_TOTAL,
)
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml import gpm_sampler
from gpuwarden.nvml.device import GpuDevice
from gpuwarden.nvml.gpm import NOT_SUPPORTED_REASON, GpmUnavailable, Window
from gpuwarden.nvml.gpm_sampler import GpmSamplerDown, GpmSamplerStarting

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


# What a MIG GPU instance answers for its own slice; PCIe and NVLink traffic belong to the whole GPU.
INSTANCE_METRICS = [metric for metric, (key, _) in METRICS.items() if not key.startswith(("pcie", "nvlink"))]
INSTANCE_METRICS.remove(nvml.NVML_GPM_METRIC_SM_OCCUPANCY)
PIPES = ("tensor", "fp64", "fp32", "fp16")


@dataclass
class InstanceGpm:
    """One MIG GPU instance's totals (its window is the sampler's), read on the GPU's fast-tier thread."""

    mig_uuid: str
    open: bool  # False: this slice cannot be sampled (counted once, not asked again)
    metric_ids: list[int] = field(default_factory=lambda: list(INSTANCE_METRICS))
    totals: dict[str, float] = field(default_factory=dict)


@dataclass
class GpmState:
    """One GPU's GPM: whether it is sampled, the metrics that answer, and the accumulated totals."""

    open: bool = False  # sampled each fast poll (its window lives in the sampler)
    unavailable: str | None = None
    supported: bool = False  # the GPU answered the support query: its MIG instances may be sampled too
    metric_ids: list[int] = field(default_factory=lambda: list(METRICS))
    totals: dict[str, float] = field(default_factory=dict)
    instances: dict[int, InstanceGpm] = field(default_factory=dict)  # MIG GPU instance ID → its GPM
    handle: object = None  # the device handle the state was opened on (None: not yet asked)


def _state(dev: GpuDevice) -> GpmState:
    state: GpmState | None = dev.state.get("gpm")
    if state is None:
        state = dev.state["gpm"] = GpmState()
    if state.handle is not None and state.handle is not dev.handle:
        # Re-discovered (a reset, a driver re-init): new handle, new buffers, new windows, support asked again.
        _close_instances(dev, state, set())
        gpm_sampler.current().close(dev.uuid)
        state.open, state.unavailable, state.supported, state.handle = False, None, False, None
    return state


def _open(dev: GpuDevice, state: GpmState) -> None:
    state.handle = dev.handle
    state.open = True  # support is asked with the first sample


def _unavailable(dev: GpuDevice, state: GpmState, reason: str) -> None:
    state.open, state.unavailable = False, reason
    if reason in (NOT_SUPPORTED_REASON, "no_permission"):
        state.supported = False  # the slices of a GPU without GPM, or without permission, answer the same
        _close_instances(dev, state, set())
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
    return state is not None and state.open  # a crashed sampler keeps the source: the counter pauses, never mixes


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    state = _state(dev)
    if state.handle is None:
        _open(dev, state)
    if state.open:
        try:
            window = gpm_sampler.current().advance(dev.uuid, dev.handle, None, state.metric_ids)
        except GpmUnavailable as exc:
            _unavailable(dev, state, exc.reason)
        except GpmSamplerStarting:
            pass  # asked again next cycle; nothing learned, nothing written
        except GpmSamplerDown as exc:  # no GPM this cycle; asked again next cycle
            state.unavailable = exc.reason
            if exc.counted:
                dev.ledger.error("gpm_sampler", exc.reason)
            _write(state.totals, out)  # the counters keep their last totals: rate() sees no window, not a reset
        else:
            state.unavailable, state.supported = None, True
            if window is not None:
                _accumulate(dev, state.metric_ids, state.totals, window)
            _write(state.totals, out)
    if state.unavailable not in (None, NOT_SUPPORTED_REASON):
        out.add(GPM_UNAVAILABLE_INFO, 1, state.unavailable)
    if state.supported:
        _read_instances(dev, state, out)


def _read_instances(dev: GpuDevice, state: GpmState, out: SampleWriter) -> None:
    """Each MIG GPU instance the slow tier found, sampled on its own window; instances destroyed since are
    dropped with their series, new ones start a window."""
    current: tuple[tuple[int, str], ...] = dev.state.get("mig_instances", ())
    _close_instances(dev, state, {gpu_instance for gpu_instance, _ in current})
    sampler = gpm_sampler.current()
    for gpu_instance, mig_uuid in current:
        instance = state.instances.get(gpu_instance)
        if instance is None or instance.mig_uuid != mig_uuid:
            if instance is not None:
                sampler.close(dev.uuid, gpu_instance)
            instance = state.instances[gpu_instance] = InstanceGpm(mig_uuid, True)
        if not instance.open:
            continue
        try:
            window_read = sampler.advance(dev.uuid, dev.handle, gpu_instance, instance.metric_ids)
        except GpmUnavailable as exc:  # this slice cannot be sampled: counted once, not asked again
            instance.open = False
            dev.ledger.error(f"nvmlGpmMigSampleGet_{gpu_instance}", exc.reason)
            continue
        except (GpmSamplerDown, GpmSamplerStarting):  # counted on the whole GPU's request
            _write_instance(str(gpu_instance), mig_uuid, instance.totals, out)
            continue
        if window_read is not None:
            _accumulate(dev, instance.metric_ids, instance.totals, window_read)
        _write_instance(str(gpu_instance), mig_uuid, instance.totals, out)


def _close_instances(dev: GpuDevice, state: GpmState, keep: set[int]) -> None:
    for gpu_instance in [g for g in state.instances if g not in keep]:
        state.instances.pop(gpu_instance)
        gpm_sampler.current().close(dev.uuid, gpu_instance)


def _accumulate(dev: GpuDevice, metric_ids: list[int], totals: dict[str, float], window: Window) -> None:
    seconds = window.seconds
    for metric, error in window.failed.items():
        if metric in metric_ids:  # a metric this driver does not serve: dropped for this GPU, counted once
            metric_ids.remove(metric)
            dev.ledger.error(f"gpm_metric_{metric}", error)
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
    for pipe in PIPES:
        out.add(GPM_PIPE_ACTIVE_SECONDS_TOTAL, totals.get(pipe), pipe)
    out.add(GPM_DRAM_ACTIVE_SECONDS_TOTAL, totals.get("dram"))
    out.add(PCIE_BYTES_TOTAL, totals.get("pcie_rx"), "rx")
    out.add(PCIE_BYTES_TOTAL, totals.get("pcie_tx"), "tx")
    out.add(NVLINK_BYTES_TOTAL, totals.get("nvlink_rx"), "rx")
    out.add(NVLINK_BYTES_TOTAL, totals.get("nvlink_tx"), "tx")


def _write_instance(gpu_instance: str, mig_uuid: str, totals: dict[str, float], out: SampleWriter) -> None:
    if "window" not in totals:
        return
    out.add(MIG_GPM_WINDOW_SECONDS_TOTAL, totals["window"], gpu_instance, mig_uuid)
    out.add(MIG_GPM_GRAPHICS_ACTIVE_SECONDS_TOTAL, totals.get("graphics"), gpu_instance, mig_uuid)
    out.add(MIG_GPM_SM_ACTIVE_SECONDS_TOTAL, totals.get("sm"), gpu_instance, mig_uuid)
    for pipe in PIPES:
        out.add(MIG_GPM_PIPE_ACTIVE_SECONDS_TOTAL, totals.get(pipe), gpu_instance, mig_uuid, pipe)
    out.add(MIG_GPM_DRAM_ACTIVE_SECONDS_TOTAL, totals.get("dram"), gpu_instance, mig_uuid)


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
        MIG_GPM_WINDOW_SECONDS_TOTAL,
        MIG_GPM_GRAPHICS_ACTIVE_SECONDS_TOTAL,
        MIG_GPM_SM_ACTIVE_SECONDS_TOTAL,
        MIG_GPM_PIPE_ACTIVE_SECONDS_TOTAL,
        MIG_GPM_DRAM_ACTIVE_SECONDS_TOTAL,
    ),
    read_fast,
)
