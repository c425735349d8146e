"""Power draw and limits (fast), energy counter (slow: 3 ms per call on H100)."""

from __future__ import annotations

from gpuwarden.collect.reader import Reader
from gpuwarden.model.families import (
    ENERGY_JOULES_TOTAL,
    POWER_DEFAULT_LIMIT_WATTS,
    POWER_LIMIT_WATTS,
    POWER_USAGE_WATTS,
)
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice


def _watts(milliwatts: int | None) -> float | None:
    return None if milliwatts is None else milliwatts / 1000.0


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    out.add(POWER_DEFAULT_LIMIT_WATTS, _watts(dev.call(nvml.nvmlDeviceGetPowerManagementDefaultLimit)))


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    out.add(POWER_USAGE_WATTS, _watts(dev.call(nvml.nvmlDeviceGetPowerUsage)))
    out.add(POWER_LIMIT_WATTS, _watts(dev.call(nvml.nvmlDeviceGetEnforcedPowerLimit)))


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    millijoules = dev.call(nvml.nvmlDeviceGetTotalEnergyConsumption)
    out.add(ENERGY_JOULES_TOTAL, None if millijoules is None else millijoules / 1000.0)


STATIC = Reader("power_default", Tier.STATIC, (POWER_DEFAULT_LIMIT_WATTS,), read_static)
FAST = Reader("power", Tier.FAST, (POWER_USAGE_WATTS, POWER_LIMIT_WATTS), read_fast)
SLOW = Reader("energy", Tier.SLOW, (ENERGY_JOULES_TOTAL,), read_slow)
