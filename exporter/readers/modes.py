"""Persistence, compute and MIG modes; running compute processes; fan."""

from __future__ import annotations

import pynvml

from exporter.nvml.device import GpuDevice
from exporter.readers import Reader
from exporter.snapshot import SampleWriter, Tier

_COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    compute = dev.call(pynvml.nvmlDeviceGetComputeMode)
    if compute is not None:
        out.info["compute_mode"] = _COMPUTE_MODES.get(compute, str(compute))
    mig = dev.call(pynvml.nvmlDeviceGetMigMode)
    if mig is not None:
        out.add("gpuwarden_mig_mode_enabled", 1 if mig[0] else 0)


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    persistence = dev.call(pynvml.nvmlDeviceGetPersistenceMode)
    out.add("gpuwarden_persistence_mode_enabled", None if persistence is None else (1 if persistence else 0))
    processes = dev.call_first(
        "processes",
        (pynvml.nvmlDeviceGetComputeRunningProcesses_v3, ()),
        (pynvml.nvmlDeviceGetComputeRunningProcesses_v2, ()),
    )
    out.add("gpuwarden_processes", None if processes is None else len(processes))


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    speed = dev.call(pynvml.nvmlDeviceGetFanSpeed)
    out.add("gpuwarden_fan_speed_ratio", None if speed is None else speed / 100.0)


STATIC = Reader("modes", Tier.STATIC, ("gpuwarden_mig_mode_enabled",), read_static)
FAST = Reader("processes", Tier.FAST, ("gpuwarden_persistence_mode_enabled", "gpuwarden_processes"), read_fast)
SLOW = Reader("fan", Tier.SLOW, ("gpuwarden_fan_speed_ratio",), read_slow)
