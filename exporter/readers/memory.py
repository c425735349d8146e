"""Device memory: v2 (used excludes the driver reserve, as nvidia-smi shows), v1 fallback on old drivers."""

from __future__ import annotations

import pynvml

from exporter.nvml.device import GpuDevice
from exporter.readers import Reader
from exporter.snapshot import SampleWriter, Tier


def _memory(dev: GpuDevice):  # noqa: ANN202 - pynvml struct
    return dev.call_first(
        "memory",
        (pynvml.nvmlDeviceGetMemoryInfo, (pynvml.nvmlMemory_v2,)),
        (pynvml.nvmlDeviceGetMemoryInfo, ()),
    )


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    mem = _memory(dev)
    if mem is not None:
        out.info["memory_total_bytes"] = int(mem.total)


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    mem = _memory(dev)
    if mem is None:
        return
    out.add("gpuwarden_memory_total_bytes", mem.total)
    out.add("gpuwarden_memory_used_bytes", mem.used)
    out.add("gpuwarden_memory_free_bytes", mem.free)
    if dev.chosen("memory") == 0:
        out.add("gpuwarden_memory_reserved_bytes", mem.reserved)
    else:
        out.info["memory_used_includes_reserved"] = True  # v1: "used" counts the driver reserve


STATIC = Reader("memory_total", Tier.STATIC, (), read_static)
FAST = Reader(
    "memory",
    Tier.FAST,
    (
        "gpuwarden_memory_total_bytes",
        "gpuwarden_memory_used_bytes",
        "gpuwarden_memory_free_bytes",
        "gpuwarden_memory_reserved_bytes",
    ),
    read_fast,
)
