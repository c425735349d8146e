"""Device memory: v2 (used excludes the driver reserve, as nvidia-smi shows), v1 fallback on old drivers."""

from __future__ import annotations

from gpuwarden.collect.reader import Reader
from gpuwarden.model.families import MEMORY_FREE_BYTES, MEMORY_RESERVED_BYTES, MEMORY_TOTAL_BYTES, MEMORY_USED_BYTES
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice


def _memory(dev: GpuDevice):  # noqa: ANN202 - pynvml struct
    return dev.call_first(
        "memory",
        (nvml.nvmlDeviceGetMemoryInfo, (nvml.nvmlMemory_v2,)),
        (nvml.nvmlDeviceGetMemoryInfo, ()),
    )


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    mem = _memory(dev)
    if mem is not None:
        out.set_info(memory_total_bytes=int(mem.total))


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    mem = _memory(dev)
    if mem is None:
        return
    out.add(MEMORY_TOTAL_BYTES, mem.total)
    out.add(MEMORY_USED_BYTES, mem.used)
    out.add(MEMORY_FREE_BYTES, mem.free)
    if dev.chosen("memory") == 0:
        out.add(MEMORY_RESERVED_BYTES, mem.reserved)
    else:
        out.set_info(memory_used_includes_reserved=True)  # v1: "used" counts the driver reserve


STATIC = Reader("memory_total", Tier.STATIC, (), read_static)
FAST = Reader(
    "memory",
    Tier.FAST,
    (
        MEMORY_TOTAL_BYTES,
        MEMORY_USED_BYTES,
        MEMORY_FREE_BYTES,
        MEMORY_RESERVED_BYTES,
    ),
    read_fast,
)
