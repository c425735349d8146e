"""Power draw and limits (fast), energy counter (slow: 3 ms per call on H100)."""

from __future__ import annotations

import pynvml

from exporter.nvml.device import GpuDevice
from exporter.readers import Reader
from exporter.snapshot import SampleWriter, Tier


def _watts(milliwatts: int | None) -> float | None:
    return None if milliwatts is None else milliwatts / 1000.0


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    out.add("gpuwarden_power_default_limit_watts", _watts(dev.call(pynvml.nvmlDeviceGetPowerManagementDefaultLimit)))


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    out.add("gpuwarden_power_usage_watts", _watts(dev.call(pynvml.nvmlDeviceGetPowerUsage)))
    out.add("gpuwarden_power_limit_watts", _watts(dev.call(pynvml.nvmlDeviceGetEnforcedPowerLimit)))


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    millijoules = dev.call(pynvml.nvmlDeviceGetTotalEnergyConsumption)
    out.add("gpuwarden_energy_joules_total", None if millijoules is None else millijoules / 1000.0)


STATIC = Reader("power_default", Tier.STATIC, ("gpuwarden_power_default_limit_watts",), read_static)
FAST = Reader("power", Tier.FAST, ("gpuwarden_power_usage_watts", "gpuwarden_power_limit_watts"), read_fast)
SLOW = Reader("energy", Tier.SLOW, ("gpuwarden_energy_joules_total",), read_slow)
