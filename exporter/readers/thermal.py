"""Temperatures: die (TemperatureV on R570+, else the deprecated getter), HBM (field 82), thresholds."""

from __future__ import annotations

import pynvml

from exporter.nvml.device import GpuDevice
from exporter.readers import Reader
from exporter.snapshot import SampleWriter, Tier

_THRESHOLDS = {
    "slowdown": pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
    "shutdown": pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN,
    "gpu_max": pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX,
    "memory_max": pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX,
}


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    for label, threshold in _THRESHOLDS.items():
        value = dev.call(pynvml.nvmlDeviceGetTemperatureThreshold, threshold, key=f"threshold_{label}")
        # Some boards answer 0 for thresholds they do not have: that is "absent", not 0 °C.
        if value:
            out.add("gpuwarden_temperature_threshold_celsius", value, label)


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    gpu = pynvml.NVML_TEMPERATURE_GPU
    out.add(
        "gpuwarden_temperature_celsius",
        dev.call_first(
            "temperature", (pynvml.nvmlDeviceGetTemperatureV, (gpu,)), (pynvml.nvmlDeviceGetTemperature, (gpu,))
        ),
    )
    fields = dev.fields([pynvml.NVML_FI_DEV_MEMORY_TEMP, pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    out.add("gpuwarden_memory_temperature_celsius", fields.get((pynvml.NVML_FI_DEV_MEMORY_TEMP, 0)))
    out.add("gpuwarden_recovery_action", fields.get((pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, 0)))


STATIC = Reader("thermal_thresholds", Tier.STATIC, ("gpuwarden_temperature_threshold_celsius",), read_static)
FAST = Reader(
    "thermal",
    Tier.FAST,
    ("gpuwarden_temperature_celsius", "gpuwarden_memory_temperature_celsius", "gpuwarden_recovery_action"),
    read_fast,
)
