"""Clocks, P-state and clock-event (throttle) reasons; cumulative throttle time from field counters."""

from __future__ import annotations

from gpuwarden.collect.reader import Reader
from gpuwarden.model.families import (
    CLOCK_EVENT_ACTIVE,
    CLOCK_EVENT_REASONS,
    CLOCK_HERTZ,
    CLOCK_MAX_HERTZ,
    PERFORMANCE_STATE,
    THROTTLE_SECONDS_TOTAL,
)
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice

_CLOCKS = {"sm": nvml.NVML_CLOCK_SM, "memory": nvml.NVML_CLOCK_MEM, "graphics": nvml.NVML_CLOCK_GRAPHICS}
_KNOWN_BITS = sum(CLOCK_EVENT_REASONS)
_PSTATE_UNKNOWN = 32
MHZ = 1_000_000

# Cumulative nanosecond counters (docs/nvml.md, Clock events). Labels follow the bitmask reasons where the meaning
# is the same; the policy counters without a bit keep their NVML name.
THROTTLE_FIELDS = {
    nvml.NVML_FI_DEV_PERF_POLICY_POWER: "sw_power_cap",
    nvml.NVML_FI_DEV_PERF_POLICY_THERMAL: "thermal_policy",
    nvml.NVML_FI_DEV_PERF_POLICY_SYNC_BOOST: "sync_boost",
    nvml.NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT: "board_limit",
    nvml.NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION: "low_utilization",
    nvml.NVML_FI_DEV_PERF_POLICY_RELIABILITY: "reliability",
    nvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN: "sw_thermal_slowdown",
    nvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: "hw_thermal_slowdown",
    nvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN: "hw_power_brake_slowdown",
}


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    for label, clock in _CLOCKS.items():
        mhz = dev.call(nvml.nvmlDeviceGetMaxClockInfo, clock, key=f"max_clock_{label}")
        out.add(CLOCK_MAX_HERTZ, None if mhz is None else mhz * MHZ, label)


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    pstate = dev.call(nvml.nvmlDeviceGetPerformanceState)
    if pstate is not None and pstate != _PSTATE_UNKNOWN:
        out.add(PERFORMANCE_STATE, pstate)
    for label, clock in _CLOCKS.items():
        mhz = dev.call(nvml.nvmlDeviceGetClockInfo, clock, key=f"clock_{label}")
        out.add(CLOCK_HERTZ, None if mhz is None else mhz * MHZ, label)
    reasons = dev.call_first(
        "clock_event_reasons",
        (nvml.nvmlDeviceGetCurrentClocksEventReasons, ()),
        (nvml.nvmlDeviceGetCurrentClocksThrottleReasons, ()),
    )
    if reasons is None:
        return
    for bit, label in CLOCK_EVENT_REASONS.items():
        out.add(CLOCK_EVENT_ACTIVE, 1 if reasons & bit else 0, label)
    out.add(CLOCK_EVENT_ACTIVE, 1 if reasons & ~_KNOWN_BITS else 0, "other")


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    values = dev.fields(THROTTLE_FIELDS)
    for field_id, label in THROTTLE_FIELDS.items():
        nanoseconds = values.get((field_id, 0))
        if nanoseconds is not None:
            out.add(THROTTLE_SECONDS_TOTAL, nanoseconds / 1e9, label)


STATIC = Reader("clocks_max", Tier.STATIC, (CLOCK_MAX_HERTZ,), read_static)
FAST = Reader(
    "clocks",
    Tier.FAST,
    (PERFORMANCE_STATE, CLOCK_HERTZ, CLOCK_EVENT_ACTIVE),
    read_fast,
)
SLOW = Reader("throttle_time", Tier.SLOW, (THROTTLE_SECONDS_TOTAL,), read_slow)
