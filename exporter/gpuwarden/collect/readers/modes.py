"""Persistence, compute and MIG modes; fan."""

from __future__ import annotations

from gpuwarden.collect.reader import Reader
from gpuwarden.model.families import FAN_SPEED_RATIO, MIG_MODE_ENABLED, PERSISTENCE_MODE_ENABLED
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice

_COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    compute = dev.call(nvml.nvmlDeviceGetComputeMode)
    if compute is not None:
        out.set_info(compute_mode=_COMPUTE_MODES.get(compute, str(compute)))
    mig = dev.call(nvml.nvmlDeviceGetMigMode)
    if mig is not None:
        out.add(MIG_MODE_ENABLED, 1 if mig[0] else 0)


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    persistence = dev.call(nvml.nvmlDeviceGetPersistenceMode)
    out.add(PERSISTENCE_MODE_ENABLED, None if persistence is None else (1 if persistence else 0))


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    speed = dev.call(nvml.nvmlDeviceGetFanSpeed)
    out.add(FAN_SPEED_RATIO, None if speed is None else speed / 100.0)


STATIC = Reader("modes", Tier.STATIC, (MIG_MODE_ENABLED,), read_static)
FAST = Reader("persistence", Tier.FAST, (PERSISTENCE_MODE_ENABLED,), read_fast)
SLOW = Reader("fan", Tier.SLOW, (FAN_SPEED_RATIO,), read_slow)
