"""Constants and ctypes helpers shared by the fake library's symbol groups."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

SAMPLE_PERIOD_S = 0.2  # H100's measured utilization sample period
SAMPLE_BUFFER = 71  # samples the driver keeps (~14 s)
_HANDLE_BASE = 0x7F0000010000
_EVENT_SET_BASE = 0x7F0000900000
_EPOCH_US = 1_795_653_828_000_000  # sample timestamps look like the real driver's (µs)
_NVSWITCH_BUS = b"FFFFFFFF:FF:FF.0"

OK = pynvml.NVML_SUCCESS
_LEVELS = {
    "PIX": pynvml.NVML_TOPOLOGY_SINGLE,
    "PXB": pynvml.NVML_TOPOLOGY_MULTIPLE,
    "PHB": pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
    "NODE": pynvml.NVML_TOPOLOGY_NODE,
    "SYS": pynvml.NVML_TOPOLOGY_SYSTEM,
}

# Throttle-time fields (ns) → the clock-event bits during which they count.
_THROTTLE_FIELD_BITS = {74: 0x4, 75: 0x60, 76: 0x10, 77: 0x0, 78: 0x1, 79: 0x0, 269: 0x20, 270: 0x40, 271: 0x80}
_NVLINK_CRC_DATA = [39, 40, 41, 42, 43, 44, 102, 103, 104, 105, 106, 107]
_NVLINK_ECC = list(range(148, 160))
_UINT, _ULL = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG


class SimulatedMemoryCorruption(RuntimeError):
    """What the real libnvidia-ml would turn into corrupted memory or a segfault, raised loudly instead."""


class _Hang(Exception):
    pass


def _out(ref: Any) -> Any:
    """The ctypes object behind a byref() argument."""
    return getattr(ref, "_obj", ref)


def _set_pointer(ref: Any, value: int) -> None:
    ctypes.c_void_p.from_buffer(_out(ref)).value = value


def _pointer_value(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _val(arg: Any) -> Any:
    return arg.value if hasattr(arg, "value") else arg
