"""MIG instances of each MIG-enabled GPU (slow tier): their UUIDs, so that pod attribution can map a container
holding a MIG slice (device plugin ID `MIG-…`) to its parent GPU. Instances are created and destroyed at run time,
hence the slow tier rather than discovery."""

from __future__ import annotations

from exporter.nvml import calls as nvml
from exporter.nvml.device import GpuDevice
from exporter.readers import Reader
from exporter.snapshot import SampleWriter, Tier


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    mode = dev.call(nvml.nvmlDeviceGetMigMode)
    if not mode or not mode[0]:
        return
    slots = dev.call(nvml.nvmlDeviceGetMaxMigDeviceCount) or 0
    uuids = []
    for slot in range(slots):
        # An empty slot answers NOT_FOUND (no data: None); a slot destroyed meanwhile, likewise.
        handle = dev.call(nvml.nvmlDeviceGetMigDeviceHandleByIndex, slot, key=f"mig_slot_{slot}")
        uuid = None if handle is None else dev.call(nvml.nvmlDeviceGetUUID, on=handle, key=f"mig_uuid_{slot}")
        if uuid is None:
            continue
        uuids.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
    out.set_info(mig_uuids=tuple(uuids))


SLOW = Reader("mig", Tier.SLOW, (), read_slow)
