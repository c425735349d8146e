"""Clocks, P-state and clock-event (throttle) reasons; cumulative throttle time from field counters."""

from __future__ import annotations

import pynvml

from exporter.metrics import CLOCK_EVENT_REASONS
from exporter.nvml.device import GpuDevice
from exporter.readers import Reader
from exporter.snapshot import SampleWriter, Tier

_CLOCKS = {"sm": pynvml.NVML_CLOCK_SM, "memory": pynvml.NVML_CLOCK_MEM, "graphics": pynvml.NVML_CLOCK_GRAPHICS}
_KNOWN_BITS = sum(CLOCK_EVENT_REASONS)
_PSTATE_UNKNOWN = 32
MHZ = 1_000_000

# Cumulative nanosecond counters (nvml.md §8). Labels follow the bitmask reasons where the meaning is the
# same; the policy counters without a bit keep their NVML name.
THROTTLE_FIELDS = {
    pynvml.NVML_FI_DEV_PERF_POLICY_POWER: "sw_power_cap",
    pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL: "thermal_policy",
    pynvml.NVML_FI_DEV_PERF_POLICY_SYNC_BOOST: "sync_boost",
    pynvml.NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT: "board_limit",
    pynvml.NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION: "low_utilization",
    pynvml.NVML_FI_DEV_PERF_POLICY_RELIABILITY: "reliability",
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN: "sw_thermal_slowdown",
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: "hw_thermal_slowdown",
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN: "hw_power_brake_slowdown",
}


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    for label, clock in _CLOCKS.items():
        mhz = dev.call(pynvml.nvmlDeviceGetMaxClockInfo, clock, key=f"max_clock_{label}")
        out.add("gpuwarden_clock_max_hertz", None if mhz is None else mhz * MHZ, label)


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    pstate = dev.call(pynvml.nvmlDeviceGetPerformanceState)
    if pstate is not None and pstate != _PSTATE_UNKNOWN:
        out.add("gpuwarden_performance_state", pstate)
    for label, clock in _CLOCKS.items():
        mhz = dev.call(pynvml.nvmlDeviceGetClockInfo, clock, key=f"clock_{label}")
        out.add("gpuwarden_clock_hertz", None if mhz is None else mhz * MHZ, label)
    reasons = dev.call_first(
        "clock_event_reasons",
        (pynvml.nvmlDeviceGetCurrentClocksEventReasons, ()),
        (pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, ()),
    )
    if reasons is None:
        return
    for bit, label in CLOCK_EVENT_REASONS.items():
        out.add("gpuwarden_clock_event_active", 1 if reasons & bit else 0, label)
    out.add("gpuwarden_clock_event_active", 1 if reasons & ~_KNOWN_BITS else 0, "other")


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    values = dev.fields(THROTTLE_FIELDS)
    for field_id, label in THROTTLE_FIELDS.items():
        nanoseconds = values.get((field_id, 0))
        if nanoseconds is not None:
            out.add("gpuwarden_throttle_seconds_total", nanoseconds / 1e9, label)


STATIC = Reader("clocks_max", Tier.STATIC, ("gpuwarden_clock_max_hertz",), read_static)
FAST = Reader(
    "clocks",
    Tier.FAST,
    ("gpuwarden_performance_state", "gpuwarden_clock_hertz", "gpuwarden_clock_event_active"),
    read_fast,
)
SLOW = Reader("throttle_time", Tier.SLOW, ("gpuwarden_throttle_seconds_total",), read_slow)
