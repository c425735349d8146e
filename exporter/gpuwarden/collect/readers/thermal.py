"""Temperatures: die (TemperatureV on R570+, else the deprecated getter), HBM (field 82), thresholds."""

from __future__ import annotations

from gpuwarden.collect.reader import Reader
from gpuwarden.model.families import (
    MEMORY_TEMPERATURE_CELSIUS,
    RECOVERY_ACTION,
    TEMPERATURE_CELSIUS,
    TEMPERATURE_THRESHOLD_CELSIUS,
)
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice

_THRESHOLDS = {
    "slowdown": nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
    "shutdown": nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN,
    "gpu_max": nvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX,
    "memory_max": nvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX,
}


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    for label, threshold in _THRESHOLDS.items():
        value = dev.call(nvml.nvmlDeviceGetTemperatureThreshold, threshold, key=f"threshold_{label}")
        # Some boards answer 0 for thresholds they do not have: that is "absent", not 0 °C.
        if value:
            out.add(TEMPERATURE_THRESHOLD_CELSIUS, value, label)


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    gpu = nvml.NVML_TEMPERATURE_GPU
    out.add(
        TEMPERATURE_CELSIUS,
        dev.call_first(
            "temperature", (nvml.nvmlDeviceGetTemperatureV, (gpu,)), (nvml.nvmlDeviceGetTemperature, (gpu,))
        ),
    )
    fields = dev.fields([nvml.NVML_FI_DEV_MEMORY_TEMP, nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    out.add(MEMORY_TEMPERATURE_CELSIUS, fields.get((nvml.NVML_FI_DEV_MEMORY_TEMP, 0)))
    out.add(RECOVERY_ACTION, fields.get((nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, 0)))


STATIC = Reader("thermal_thresholds", Tier.STATIC, (TEMPERATURE_THRESHOLD_CELSIUS,), read_static)
FAST = Reader(
    "thermal",
    Tier.FAST,
    (TEMPERATURE_CELSIUS, MEMORY_TEMPERATURE_CELSIUS, RECOVERY_ACTION),
    read_fast,
)
