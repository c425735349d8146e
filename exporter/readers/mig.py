"""MIG instances of each MIG-enabled GPU (slow tier): their UUIDs, so that pod attribution can map a container
holding a MIG slice (device plugin ID `MIG-…`) to its parent GPU. Instances are created and destroyed at run time,
hence the slow tier rather than discovery."""

from __future__ import annotations

import pynvml

from exporter.nvml.device import GpuDevice
from exporter.readers import Reader
from exporter.snapshot import SampleWriter, Tier


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    mode = dev.call(pynvml.nvmlDeviceGetMigMode)
    if not mode or not mode[0]:
        return
    slots = dev.call(pynvml.nvmlDeviceGetMaxMigDeviceCount) or 0
    uuids = []
    for slot in range(slots):
        try:
            handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(dev.handle, slot)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
        except pynvml.NVMLError:  # an empty slot answers NOT_FOUND; a slot destroyed meanwhile, likewise
            continue
        uuids.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
    out.info["mig_uuids"] = uuids


SLOW = Reader("mig", Tier.SLOW, (), read_slow)
